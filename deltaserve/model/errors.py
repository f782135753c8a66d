"""The loader's error type, apart from the loader so that the quantized formats (layers/quant) can raise it too."""


class WeightLoadError(RuntimeError):
    """A checkpoint could not be loaded; the message names the file or tensor."""
