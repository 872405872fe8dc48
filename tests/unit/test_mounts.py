"""exporter.util.mounts: mountinfo lines as the kernel writes them."""
from exporter.util.mounts import Mount, parse, read

LINES = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate
36 24 0:31 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
40 22 0:12 / /sys/kernel/tracing rw,nosuid shared:20 master:3 - tracefs tracefs rw
41 22 0:4 net:[4026532290] /run/netns/a\\040b rw - nsfs nsfs rw
not a mountinfo line
42 22 0:5 / /x rw -
"""


def test_fields_separator_and_optional_fields():
    m = parse(LINES)
    assert [x.fstype for x in m] == ["ext4", "cgroup2", "cgroup", "tracefs", "nsfs"]
    assert m[1] == Mount("/", "/sys/fs/cgroup/unified", "cgroup2", "cgroup2", "rw,nsdelegate")
    assert m[3].mountpoint == "/sys/kernel/tracing"          # two optional fields before "-"


def test_octal_escapes_and_nsfs_roots():
    nsfs = parse(LINES)[4]
    assert (nsfs.root, nsfs.mountpoint) == ("net:[4026532290]", "/run/netns/a b")


def test_malformed_lines_are_skipped_and_this_process_parses():
    assert len(parse(LINES)) == 5
    assert any(m.mountpoint == "/" for m in read())
