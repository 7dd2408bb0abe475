from ._daxkv import DaxConfigError as DaxConfigError
from ._daxkv import DaxConnector as DaxConnector
from ._daxkv import LeaseError as LeaseError
from ._daxkv import ReadLease as ReadLease
from ._daxkv import StoreLease as StoreLease

__all__ = [
    "DaxConfigError",
    "DaxConnector",
    "LeaseError",
    "ReadLease",
    "StoreLease",
]
