"""Kernel test of the node-wide program view's names: the kernel keeps 15
characters of a program's name, the node view reads the whole name from the
program's BTF (as bpftool does), so it names nettap's programs exactly as
the own-scope series (libbpf's names) do."""
import ctypes
import os


from exporter.kernel import _native, bpfstats, libbpf, loader


BPF_PROG_TYPE_SOCKET_FILTER = 1


def test_node_view_names_nettaps_programs_in_full():
    with loader.Probes() as p:
        ids = {bpfstats.prog_info(fd).id: name for name, fd in p.prog_fds.items()}
        cache = {}
        node = {pid_: name.decode() for pid_, name, *_ in bpfstats.node_programs(cache)}
        assert {i: node.get(i) for i in ids} == ids
        long_names = [n for n in ids.values() if len(n) > 15]
        assert long_names                                      # the test tests something
        for name in long_names:                                # the kernel's own name is cut
            assert bpfstats.prog_info(p.prog_fds[name]).name == name.encode()[:15]
        if p.states["tcp_sendmsg"].mechanism == "tracepoint":
            assert "tcp_sendmsg_enter_iov" in node.values()
        again = {pid_: name.decode() for pid_, name, *_ in bpfstats.node_programs(cache)}
        assert {i: again[i] for i in ids} == ids               # from the cache, the same


def test_program_without_btf_keeps_the_kernels_name():
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)    # r0 = 0; exit
    fd = libbpf.call("bpf_prog_load", BPF_PROG_TYPE_SOCKET_FILTER, b"no_btf_long_program_name", b"GPL", insns, 2, None)
    try:
        pid_ = bpfstats.prog_info(fd).id
        node = {i: name for i, name, *_ in bpfstats.node_programs({})}
        assert node[pid_] == b"no_btf_long_pro"
    finally:
        os.close(fd)


def _walk_by_libbpf():
    """The node's programs walked with libbpf's calls, one at a time (what
    the compiled walk replaced): id -> (kernel name, type)."""
    lb, out, cur = libbpf.lib(), {}, ctypes.c_uint32(0)
    while lb.bpf_prog_get_next_id(cur.value, ctypes.byref(cur)) == 0:
        fd = lb.bpf_prog_get_fd_by_id(cur.value)
        if fd >= 0:
            info = bpfstats.prog_info(fd)
            out[info.id] = (info.name, info.type)
            os.close(fd)
    return out


def test_compiled_walk_sees_what_libbpf_sees():
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)    # r0 = 0; exit
    fd = libbpf.call("bpf_prog_load", BPF_PROG_TYPE_SOCKET_FILTER, b"walk_me", b"GPL", insns, 2, None)
    before = set(os.listdir("/proc/self/fd"))
    try:
        mine = bpfstats.prog_info(fd).id
        walked = {i: (name, ptype) for i, name, ptype, _cnt, _ns in _native.programs()}
        assert walked[mine] == (b"walk_me", BPF_PROG_TYPE_SOCKET_FILTER)
        by_libbpf = _walk_by_libbpf()
        same = set(walked) & set(by_libbpf)                    # other tools may load and unload meanwhile
        assert mine in same and {i: walked[i] for i in same} == {i: by_libbpf[i] for i in same}
        assert set(os.listdir("/proc/self/fd")) == before      # every fd the walk opened is closed
    finally:
        os.close(fd)
