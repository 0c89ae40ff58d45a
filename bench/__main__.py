from cupy_flash.benchmark import main

main(prog="python -m bench")
