"""The labelled stand-ins for hardware no machine here has (the RK3588 NPU runtime). Part of the source checkout for
tests and bench/, never of the installed wheel (pyproject.toml excludes this package): a board runs the real
rknn-toolkit-lite2."""
