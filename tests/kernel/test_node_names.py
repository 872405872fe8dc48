"""Kernel test of the node-wide program view's names: the kernel keeps 15
characters of a program's name, the node view reads the whole name from the
program's BTF (as bpftool does), so it names nettap's programs exactly as
the own-scope series (libbpf's names) do."""
import ctypes
import os


from exporter.kernel import bpfstats, libbpf, loader


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
