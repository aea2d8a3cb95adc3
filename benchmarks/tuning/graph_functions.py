"""What a captured CUDA graph launches, read from the driver: every kernel node's function (name and attributes),
its node attributes and the types of the edges into it.  ``launch_state --graph-functions`` snapshots the probe's
graphs after every stage and prints what a stage changed, to test whether the launch-gap state lives in something
the graphs share with later builds (their CUfunctions' attributes, node attributes, programmatic edges).

Read through ``libcuda`` with ctypes (no extra package): ``cuGraphGetNodes``, ``cuGraphNodeGetType``,
``cuGraphKernelNodeGetParams_v2``, ``cuGraphKernelNodeGetAttribute``, ``cuGraphGetEdges_v2``, ``cuFuncGetAttribute``
and ``cuFuncGetName``.  A call the driver refuses is recorded as its error code, not raised.
"""

from __future__ import annotations

import ctypes

#: CUfunction_attribute values read for every kernel's function.
FUNC_ATTRS = {"max_threads": 0, "shared_static": 1, "const": 2, "local": 3, "regs": 4, "ptx": 5, "binary": 6,
              "cache_mode_ca": 7, "max_dynamic_shared": 8, "carveout": 9, "cluster_must_be_set": 10,
              "non_portable_cluster": 14, "cluster_policy": 15}
#: CUlaunchAttributeID values read for every kernel node (the first 4 bytes of the value).
NODE_ATTRS = {"cooperative": 2, "cluster_policy": 5, "programmatic": 6, "priority": 8, "mem_sync_domain": 10,
              "carveout": 14}
KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class Driver:
    """The driver calls this module makes, each returning its values (or an ``int`` CUresult where it failed)."""

    def __init__(self, lib=None):
        self.lib = lib or ctypes.CDLL("libcuda.so.1")

    def nodes(self, graph: int) -> list[int] | int:
        n = ctypes.c_size_t(0)
        rc = self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n))
        if rc:
            return rc
        arr = (ctypes.c_void_p * n.value)()
        rc = self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), arr, ctypes.byref(n))
        return rc or [int(x or 0) for x in arr[: n.value]]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int(-1)
        rc = self.lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        return -rc if rc else t.value

    def kernel_params(self, node: int) -> dict | int:
        p = _KernelParams()
        rc = self.lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p))
        return rc or {"func": int(p.func or 0), "grid": tuple(p.grid), "block": tuple(p.block), "shared": p.shared}

    def node_attr(self, node: int, attr: int) -> int | str:
        buf = (ctypes.c_ubyte * 64)()
        rc = self.lib.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), ctypes.c_int(attr), buf)
        return f"error {rc}" if rc else int.from_bytes(bytes(buf[:4]), "little", signed=True)

    def func_attr(self, func: int, attr: int) -> int | str:
        v = ctypes.c_int(0)
        rc = self.lib.cuFuncGetAttribute(ctypes.byref(v), ctypes.c_int(attr), ctypes.c_void_p(func))
        return f"error {rc}" if rc else v.value

    def func_name(self, func: int) -> str:
        name = ctypes.c_char_p()
        rc = self.lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func))
        return f"error {rc}" if rc else (name.value or b"").decode(errors="replace")

    def edges(self, graph: int) -> list[tuple[int, int, int]] | int:
        """(from, to, type) of every edge: type 0 default, 1 programmatic, 2 launch completion."""
        n = ctypes.c_size_t(0)
        rc = self.lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n))
        if rc:
            return rc
        frm, to, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (_EdgeData * n.value)()
        rc = self.lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), frm, to, data, ctypes.byref(n))
        return rc or [(int(frm[i] or 0), int(to[i] or 0), data[i].type) for i in range(n.value)]


def snapshot(graph: int, drv: Driver) -> list[dict] | str:
    """One row per kernel node of ``graph`` (a cudaGraph_t as an int), in the driver's node order: the function's
    handle, name and :data:`FUNC_ATTRS`, the node's :data:`NODE_ATTRS`, its grid, block and dynamic shared memory,
    and the types of the edges into it; or the error of the node query."""
    nodes = drv.nodes(graph)
    if isinstance(nodes, int):
        return f"cuGraphGetNodes error {nodes}"
    edges = drv.edges(graph)
    into: dict[int, list[int]] = {}
    for _frm, to, kind in ([] if isinstance(edges, int) else edges):
        into.setdefault(to, []).append(kind)
    rows = []
    for node in nodes:
        if drv.node_type(node) != KERNEL_NODE:
            continue
        p = drv.kernel_params(node)
        row = {"node": node, "edges_in": sorted(into.get(node, [])) if not isinstance(edges, int) else f"error {edges}"}
        if isinstance(p, int):
            row["error"] = f"cuGraphKernelNodeGetParams error {p}"
        else:
            f = p["func"]
            row.update(func=f, name=drv.func_name(f), grid=p["grid"], block=p["block"], shared=p["shared"],
                       func_attrs={k: drv.func_attr(f, v) for k, v in FUNC_ATTRS.items()})
        row["node_attrs"] = {k: drv.node_attr(node, v) for k, v in NODE_ATTRS.items()}
        rows.append(row)
    return rows


def changes(before: list[dict] | str, after: list[dict] | str, most: int = 5) -> list[str]:
    """What differs between two snapshots of one graph, node by node: a line per changed field (the first
    ``most`` nodes of each), and the count of nodes each field changed in."""
    if isinstance(before, str) or isinstance(after, str):
        return [] if before == after else [f"snapshot: {before if isinstance(before, str) else 'ok'} -> "
                                           f"{after if isinstance(after, str) else 'ok'}"]
    if [r["node"] for r in before] != [r["node"] for r in after]:
        return [f"kernel nodes: {len(before)} -> {len(after)} (not the same nodes)"]
    seen: dict[str, int] = {}
    lines = []
    for a, b in zip(before, after):
        for key in sorted(set(a) | set(b)):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, dict) and isinstance(vb, dict):
                diffs = [(f"{key}.{k}", va.get(k), vb.get(k)) for k in sorted(set(va) | set(vb))
                         if va.get(k) != vb.get(k)]
            else:
                diffs = [(key, va, vb)] if va != vb else []
            for field, x, y in diffs:
                seen[field] = seen.get(field, 0) + 1
                if seen[field] <= most:
                    lines.append(f"{b.get('name', a.get('name', '?'))}: {field} {x} -> {y}")
    return lines + [f"{field}: changed in {n} of {len(after)} kernel nodes" for field, n in sorted(seen.items())]
