"""Checks of the parsed arguments and of the inputs they name, run by `validate_args` or at
start-up before any work: one module per concern (`argument_validation_<family>`,
`<topic>_checks`, `<topic>_args` rules), each raising one-line `ValueError`s naming the flag and
the numbers.
"""
