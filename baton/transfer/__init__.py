"""Streaming state between processes: chunked, checksummed, authenticated."""

from baton.transfer.client import FetchStats, fetch_state
from baton.transfer.protocol import FlatState, TransferError
from baton.transfer.server import TransferServer

__all__ = ["FetchStats", "FlatState", "TransferError", "TransferServer", "fetch_state"]
