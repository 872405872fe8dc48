"""exporter.kernel.privileges without privileges: what is kept after attach, and the
README's list of capabilities equals the code's."""
import re
from pathlib import Path

from exporter.kernel import privileges
from exporter.kernel.privileges import CAPS, kept, mask_of, names

README = Path(__file__).resolve().parents[2] / "README.md"


def test_root_keeps_only_what_reloads_use():
    assert names(kept((1 << 41) - 1)) == ["CAP_DAC_READ_SEARCH", "CAP_NET_BIND_SERVICE", "CAP_SYS_PTRACE",
                                          "CAP_SYS_ADMIN"]


def test_the_documented_minimum_keeps_nothing():
    assert kept(mask_of(privileges.REQUIRED + privileges.REQUIRED_BEFORE_5_11)) == 0


def test_dac_read_search_stays_only_for_scope_node():
    assert kept(mask_of(["CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"])) == mask_of(["CAP_SYS_PTRACE"])
    assert kept(mask_of(["CAP_DAC_READ_SEARCH", "CAP_SYS_ADMIN", "CAP_BPF"])) == mask_of(
        ["CAP_DAC_READ_SEARCH", "CAP_SYS_ADMIN"])


def test_names_of_unknown_bits():
    assert names(mask_of(["CAP_BPF"]) | 1 << 5) == ["cap5", "CAP_BPF"]
    assert CAPS["CAP_BPF"] == 39 and CAPS["CAP_PERFMON"] == 38 and CAPS["CAP_SYS_ADMIN"] == 21


def test_readme_lists_exactly_the_required_capabilities():
    section = README.read_text().split("## Privileges", 1)[1].split("\n## ", 1)[0]
    required = re.findall(r"^\| `(CAP_[A-Z_]+)` \| \*\*required\*\*", section, re.M)
    assert required == list(privileges.REQUIRED)
    before = re.findall(r"^\| `(CAP_[A-Z_]+)` \| \*\*required before Linux 5\.11\*\*", section, re.M)
    assert before == list(privileges.REQUIRED_BEFORE_5_11)
    before = re.findall(r"^\| `(CAP_[A-Z_]+)` \| \*\*required before Linux 6\.2\*\*", section, re.M)
    assert before == list(privileges.REQUIRED_BEFORE_6_2)
    kept_after = re.findall(r"^\| `(CAP_[A-Z_]+)` \|(?:[^|]*\|){2} kept", section, re.M)
    assert sorted(kept_after) == sorted(privileges.KEEP + privileges.KEEP_WITH_SYS_ADMIN)


def test_capture_tls_keeps_perfmon_for_libssl_files_found_later():
    required = mask_of(privileges.REQUIRED)
    assert kept(required, tls=True) == mask_of(["CAP_PERFMON"])
    assert kept(required, tls=False) == 0
