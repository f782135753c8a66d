"""The one exception type for bad benchmark input; the CLI turns it into a one-line error and exit code 2."""


class BenchInputError(ValueError):
    """A flag, file, server or tokenizer problem the user can fix; the message names what and where."""
