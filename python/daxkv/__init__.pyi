from ._daxkv import DaxConfigError as DaxConfigError
from ._daxkv import DaxConnector as DaxConnector

__all__ = ["DaxConfigError", "DaxConnector"]
