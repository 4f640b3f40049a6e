"""The PS's sparse-table ops (Libra): ``sparse_open``, ``sparse_push``, ``sparse_pull``, ``sparse_sync``.

:class:`SparseTables` holds the tables of one PS (:class:`~netagg.hoststack.sparse_store.TableState`)
and answers the requests for them; :class:`~netagg.hoststack.server.KVServer` puts its
:meth:`~SparseTables.handlers` in its handler table. The ops are listed in docs/hoststack.md.
"""

from __future__ import annotations

import threading
from typing import Any

from netagg.framed_server import Frame, Handler
from netagg.hoststack.hotset import COUNT_DTYPE, KEY_DTYPE, HotSet
from netagg.hoststack.sparse_store import ROW_DTYPE, TableSpec, TableState, check_keys, pack_arrays, unpack_arrays

#: Sparse tables one PS holds at most (each keeps two iterations of cold rows).
MAX_TABLES = 64


class SparseTables:
    """The sparse tables of one PS (by id) and the requests for them.

    ``pull_timeout`` bounds how long a pull or sync waits for its iteration.
    """

    def __init__(self, num_workers: int, pull_timeout: float) -> None:
        self.num_workers = num_workers
        self.pull_timeout = pull_timeout
        #: Sparse tables by id: cold rows per iteration and the hot set.
        self.tables: dict[int, TableState] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Handler]:
        """The ops, for the PS's handler table."""
        return {"sparse_open": self._op_open, "sparse_push": self._op_push, "sparse_pull": self._op_pull,
                "sparse_sync": self._op_sync}

    def _table(self, header: dict[str, Any]) -> TableState:
        table = self.tables.get(int(header["table"]))
        if table is None:
            raise ValueError(f"sparse table {header['table']} was not opened")
        return table

    def _timeout(self, header: dict[str, Any]) -> float:
        return min(float(header.get("timeout", self.pull_timeout)), self.pull_timeout)

    def _op_open(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        spec = TableSpec.from_header(frame.header)
        with self._lock:
            table = self.tables.get(spec.table)
            if table is None:
                if len(self.tables) >= MAX_TABLES:
                    raise ValueError(f"this PS holds {MAX_TABLES} sparse tables already")
                table = self.tables[spec.table] = TableState(spec, self.num_workers)
            elif table.spec != spec:
                raise ValueError(f"sparse table {spec.table} is open as {table.spec}, this worker asks {spec}")
        return {"ok": True}, b""

    def _op_push(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        table = self._table(header)
        count, width = int(header["count"]), table.spec.width
        report_count, handover_count = int(header.get("report_count", -1)), int(header.get("handover_count", -1))
        layout = [(KEY_DTYPE, count, 0), (ROW_DTYPE, count, width)]
        if report_count >= 0:
            if report_count > max(2 * table.spec.capacity, 1024):
                raise ValueError(f"a frequency report of {report_count} keys; at most "
                                 f"{max(2 * table.spec.capacity, 1024)} for this table")
            layout += [(KEY_DTYPE, report_count, 0), (COUNT_DTYPE, report_count, 0)]
        if handover_count >= 0:
            layout += [(KEY_DTYPE, handover_count, 0), (ROW_DTYPE, handover_count, width)]
        arrays = unpack_arrays(frame.blob, *layout)
        keys, rows = arrays[0], arrays[1]
        report = (arrays[2], arrays[3]) if report_count >= 0 else None
        handover = (arrays[-2], arrays[-1]) if handover_count >= 0 else None
        if report is not None:
            check_keys(report[0], table.spec.num_rows)
        table.push(int(header["rank"]), int(header["iteration"]), int(header["version"]), keys, rows, report,
                   handover)
        return {"ok": True}, b""

    def _op_pull(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        table = self._table(header)
        iteration, count = int(header["iteration"]), int(header["count"])
        asked = unpack_arrays(frame.blob, (KEY_DTYPE, count, 0))[0] if count >= 0 else None
        timeout = self._timeout(header)
        keys, rows = table.pull(iteration, asked, timeout)
        response, hot_blob = _hot_set_response(table, table.sync(iteration + 1, timeout), int(header["version"]))
        return {**response, "count": int(keys.size)}, pack_arrays(keys, rows) + hot_blob

    def _op_sync(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        table = self._table(header)
        hot = table.sync(int(header["iteration"]), self._timeout(header))
        return _hot_set_response(table, hot, int(header["version"]))


def _hot_set_response(table: TableState, hot: HotSet, known_version: int) -> tuple[dict[str, Any], bytes]:
    """The hot set as response fields; its keys (and, sgd, the arriving rows' weights) when the worker lacks it."""
    if hot.version == known_version:
        return {"ok": True, "hot_version": hot.version, "hot_effective": hot.effective, "hot_count": -1,
                "arriving": 0}, b""
    arriving, weights = table.arriving(hot, known_version)
    return ({"ok": True, "hot_version": hot.version, "hot_effective": hot.effective, "hot_count": int(hot.keys.size),
             "arriving": int(arriving.size)}, pack_arrays(hot.keys, arriving, weights))
