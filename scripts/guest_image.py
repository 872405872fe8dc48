"""The ext4 image a kernel matrix guest mounts its Python from (scripts/kernel_matrix.py's x86
guests, scripts/arm64_guest.py's): a staging directory made into a file system image, no journal,
read-only in the guest."""
import os
import subprocess
import sys


def ext4(staging: str, dst: str, label: str) -> int:
    """dst: an ext4 image of staging's files (replacing dst); returns the files' size in bytes."""
    size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(staging) for f in fs)
    if os.path.exists(dst):
        os.remove(dst)
    # room for the metadata and every small file's block: the files' size x 1.5 + 64 MiB
    subprocess.run(["mke2fs", "-q", "-t", "ext4", "-O", "^has_journal", "-d", staging, "-L", label,
                    dst, f"{(size * 3 // 2 >> 20) + 64}M"], check=True, stdout=subprocess.DEVNULL)
    print(f"kernel-matrix: packed {size >> 20} MiB of Python for the {label} guests", file=sys.stderr, flush=True)
    return size
