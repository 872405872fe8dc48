"""Finding libssl files (exporter/kernel/tls.py) in a fake /proc."""
import os

from exporter.kernel import libfiles, tls


def test_only_openssls_versioned_libssl_is_taken():
    assert tls.is_libssl("/usr/lib/x86_64-linux-gnu/libssl.so.3")
    assert tls.is_libssl("libssl.so.1.1")
    assert not tls.is_libssl("libssl3.so")          # NSS's
    assert not tls.is_libssl("libssl.so")           # the linker's dev symlink, not a loaded file
    assert not tls.is_libssl("libssl.so.3.bak")


def test_map_lines_name_each_mapped_file_once_by_its_device_and_inode():
    maps = ("7f00-7f01 r-xp 0001f000 08:01 339900 /usr/lib/x86_64-linux-gnu/libssl.so.3\n"
            "7f01-7f02 r--p 00000000 08:01 339900 /usr/lib/x86_64-linux-gnu/libssl.so.3\n"
            "7f03-7f04 r-xp 00000000 00:2a 77 /opt/app/lib/libssl.so.1.1 (deleted)\n"
            "7f05-7f06 r-xp 00000000 08:01 5 /usr/lib/libssl3.so\n"
            "7f07-7f08 r-xp 00000000 00:00 0 [vdso]\n"
            # the dynamic linker mapped the file read-only, its code not yet (a
            # dlopen record is made at the entry of the code's mmap)
            "7f09-7f0a r--p 00000000 fd:1b 99 /srv/venv lib/libssl.so.3\n").encode()
    lines = libfiles.map_lines(maps, 100, tls.is_libssl)
    assert [(ln.range, ln.key, ln.path) for ln in lines] == [
        ("7f00-7f01", (os.makedev(8, 1), 339900), "/usr/lib/x86_64-linux-gnu/libssl.so.3"),
        ("7f03-7f04", (os.makedev(0, 0x2a), 77), "/opt/app/lib/libssl.so.1.1"),   # deleted: by map_files
        ("7f09-7f0a", (os.makedev(0xfd, 0x1b), 99), "/srv/venv lib/libssl.so.3"),
    ]
    assert {ln.pid for ln in lines} == {100}


def test_programs_of_each_variant():
    assert tls.programs("fast")[:2] == ["ssl_write_exit", "ssl_read_exit"]
    assert tls.programs("compat")[:2] == ["ssl_write_exit_compat", "ssl_read_exit_compat"]
    assert len(tls.programs("fast")) == 10


def test_a_range_is_named_as_map_files_names_it():
    """maps pads an address to 8 hex digits, map_files does not ("%lx"): a
    non-PIE Go program at 0x400000 is map_files/400000-663000."""
    maps = b"00400000-00663000 r-xp 00000000 fe:00 2236594 /usr/local/bin/server\n"
    assert [ln.range for ln in libfiles.map_lines(maps, 7, lambda p: True)] == ["400000-663000"]
