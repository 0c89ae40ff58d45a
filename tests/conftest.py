import os

import helpers
from hypothesis import HealthCheck, settings

# Example counts: "gpu" for a GPU run (the default when one is present), "quick" for a short pass.
settings.register_profile("gpu", max_examples=int(os.environ.get("CUPY_FLASH_EXAMPLES", "100")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("quick", max_examples=10, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("cpu", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if helpers.HAS_GPU else "cpu"))


def pytest_report_header(config):
    return [f"cupy_flash GPU tests: {'enabled' if helpers.HAS_GPU else 'skipped: ' + helpers.NO_GPU_REASON}",
            f"hypothesis profile: {settings._current_profile}, max_examples={settings().max_examples}"]


def pytest_terminal_summary(terminalreporter):
    if helpers.EXAMPLES:
        terminalreporter.section("hypothesis examples run per property")
        for prop, count in sorted(helpers.EXAMPLES.items()):
            terminalreporter.write_line(f"{prop:40s} {count}")
    if helpers.NOTES:
        terminalreporter.section("figures")
        for line in helpers.NOTES:
            terminalreporter.write_line(line)
    if helpers.WORST_USED:
        terminalreporter.section("error rule: worst case per quantity")
        terminalreporter.write_line(f"{'quantity':10s} {'err/bound':>9s} {'err/low':>9s}  example")
        for quantity, (used, ratio, context) in sorted(helpers.WORST_USED.items()):
            terminalreporter.write_line(f"{quantity:10s} {used:9.3f} {ratio:9.3f}  {context}")
