from bench.attention import main

main()
