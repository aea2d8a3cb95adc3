"""benchmarks/tuning/graph_functions.py on the CPU: the driver calls' marshalling against a fake libcuda, and the
snapshot and its diff against a fake driver (the GPU command reads real graphs)."""

from __future__ import annotations

import ctypes

from benchmarks.tuning import graph_functions as gf


class FakeLib:
    """libcuda's calls over one graph: nodes 11 (kernel, func 101), 12 (memset), 13 (kernel, func 102); edges 11 ->
    13 (programmatic) and 12 -> 13 (default); function attributes attr * 10 + func % 100, and node attributes attr
    + node; func 102's name query fails."""

    nodes, kinds, funcs = [11, 12, 13], {11: 0, 12: 2, 13: 0}, {11: 101, 13: 102}
    edges = [(11, 13, 1), (12, 13, 0)]

    def cuGraphGetNodes(self, graph, arr, n):
        if arr is not None:
            for i, v in enumerate(self.nodes):
                arr[i] = v
        n._obj.value = len(self.nodes)
        return 0

    def cuGraphNodeGetType(self, node, t):
        t._obj.value = self.kinds[node.value]
        return 0

    def cuGraphKernelNodeGetParams_v2(self, node, p):
        p._obj.func, p._obj.shared = self.funcs[node.value], 64
        p._obj.grid[0], p._obj.block[0] = 8, 128
        return 0

    def cuGraphKernelNodeGetAttribute(self, node, attr, buf):
        buf[:4] = list((attr.value + node.value).to_bytes(4, "little"))
        return 0

    def cuFuncGetAttribute(self, v, attr, func):
        v._obj.value = attr.value * 10 + func.value % 100
        return 0

    def cuFuncGetName(self, name, func):
        if func.value == 102:
            return 500
        name._obj.value = b"kern_a"
        return 0

    def cuGraphGetEdges_v2(self, graph, frm, to, data, n):
        if frm is not None:
            for i, (a, b, k) in enumerate(self.edges):
                frm[i], to[i] = a, b
                data[i].type = k
        n._obj.value = len(self.edges)
        return 0


def test_snapshot_reads_kernel_nodes_their_functions_attributes_and_edges():
    rows = gf.snapshot(7, gf.Driver(FakeLib()))
    assert [r["node"] for r in rows] == [11, 13]  # the memset is not a kernel node
    a, b = rows
    assert (a["func"], a["name"], a["grid"], a["block"], a["shared"]) == (101, "kern_a", (8, 0, 0), (128, 0, 0), 64)
    assert b["name"] == "error 500" and b["edges_in"] == [0, 1] and a["edges_in"] == []
    assert a["func_attrs"] == {k: v * 10 + 1 for k, v in gf.FUNC_ATTRS.items()}
    assert b["node_attrs"] == {k: v + 13 for k, v in gf.NODE_ATTRS.items()}


def test_a_failing_node_query_is_reported_not_raised():
    lib = FakeLib()
    lib.cuGraphGetNodes = lambda graph, arr, n: 999
    assert gf.snapshot(7, gf.Driver(lib)) == "cuGraphGetNodes error 999"


def test_changes_name_the_field_and_count_the_nodes():
    rows = gf.snapshot(7, gf.Driver(FakeLib()))
    assert gf.changes(rows, rows) == []
    after = [dict(r, func_attrs=dict(r["func_attrs"], carveout=-1)) for r in rows]
    after[1]["edges_in"] = [0, 0]
    lines = gf.changes(rows, after)
    assert "kern_a: func_attrs.carveout 91 -> -1" in lines
    assert "func_attrs.carveout: changed in 2 of 2 kernel nodes" in lines
    assert "edges_in: changed in 1 of 2 kernel nodes" in lines
    assert gf.changes(rows, rows[:1]) == ["kernel nodes: 2 -> 1 (not the same nodes)"]
    assert gf.changes("cuGraphGetNodes error 1", rows) == ["snapshot: cuGraphGetNodes error 1 -> ok"]


def test_the_kernel_params_struct_is_cuda_kernel_node_params_v2():
    # func, grid[3], block[3], shared (then 4 bytes of padding, as in C), params, extra, kern, ctx on a 64-bit host
    assert gf._KernelParams.params.offset == 40 and ctypes.sizeof(gf._KernelParams) == 72
    assert gf._EdgeData.type.offset == 2 and ctypes.sizeof(gf._EdgeData) == 8
