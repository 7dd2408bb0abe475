from ._daxkv import DaxConnector as DaxConnector

__all__ = ["DaxConnector"]
