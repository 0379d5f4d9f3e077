"""nbgen's version string (``nbgen.__version__``; ``get_server_info()["version"]``)."""

__version__ = "0.1.0"
