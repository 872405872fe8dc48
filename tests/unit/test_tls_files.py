"""Finding libssl files (exporter/kernel/tls.py) in a fake /proc."""
from exporter.kernel import tls


def test_only_openssls_versioned_libssl_is_taken():
    assert tls.is_libssl("/usr/lib/x86_64-linux-gnu/libssl.so.3")
    assert tls.is_libssl("libssl.so.1.1")
    assert not tls.is_libssl("libssl3.so")          # NSS's
    assert not tls.is_libssl("libssl.so")           # the linker's dev symlink, not a loaded file
    assert not tls.is_libssl("libssl.so.3.bak")


def test_mapped_files_are_found_through_each_process_root(tmp_path):
    proc = tmp_path
    (proc / "self").mkdir()
    for pid, maps in {
        "100": "7f00-7f01 r-xp 0001f000 08:01 339900 /usr/lib/x86_64-linux-gnu/libssl.so.3\n"
               "7f01-7f02 r--p 00000000 08:01 339900 /usr/lib/x86_64-linux-gnu/libssl.so.3\n",
        "200": "7f00-7f01 r-xp 00000000 00:2a 77 /opt/app/lib/libssl.so.1.1 (deleted)\n",
        "300": "7f00-7f01 r-xp 00000000 08:01 5 /usr/lib/libssl3.so\n"
               "7f00-7f01 r-xp 00000000 00:00 0 [vdso]\n",
        # the dynamic linker mapped the file read-only, its code not yet (a
        # dlopen record is made at the entry of the code's mmap)
        "500": "7f00-7f09 r--p 00000000 08:01 99 /srv/venv/lib/libssl.so.3\n",
    }.items():
        (proc / pid).mkdir()
        (proc / pid / "maps").write_text(maps)
    (proc / "400").mkdir()                          # gone, or a kernel thread: no maps
    assert sorted(tls.mapped_files(str(proc))) == [
        f"{proc}/100/root/usr/lib/x86_64-linux-gnu/libssl.so.3",
        f"{proc}/200/map_files/7f00-7f01",             # deleted: the mapping itself
        f"{proc}/500/root/srv/venv/lib/libssl.so.3",
    ]


def test_programs_of_each_variant():
    assert tls.programs("fast")[:2] == ["ssl_write_exit", "ssl_read_exit"]
    assert tls.programs("compat")[:2] == ["ssl_write_exit_compat", "ssl_read_exit_compat"]
    assert len(tls.programs("fast")) == 10
