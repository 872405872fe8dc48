"""The README's run command on this kernel: scripts/run.sh starts nettap
with its built-in default config and /readyz answers 200 once the probes
are attached. The kernel matrix runs this in every guest kernel.

Capturing nothing and scraped, it has not loaded numpy (~15 MB of RSS):
only a copied batch or a capture imports it (issue 31)."""
import signal
import subprocess

import requests

from procs import ROOT, free_port, wait_for



def test_run_script_reaches_ready():
    port = free_port()
    p = subprocess.Popen([str(ROOT / "scripts" / "run.sh"), "--web.listen-address", f"127.0.0.1:{port}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Generous: under emulation (the kernel matrix) verifying the programs takes a minute.
        r = wait_for(lambda: requests.get(f"http://127.0.0.1:{port}/readyz", timeout=1), timeout=300,
                     what="/readyz", step=0.3)
        assert r.status_code == 200, r.text
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'nettap_probe_attached{mechanism="none"' not in text
        assert 'nettap_bpf_variant_info{variant=' in text
        assert 'nettap_tcp_resets_total{direction="sent"} 0.0' in text       # the obs_counters sums
        assert 'nettap_probe_calls_total{probe="tcp_sendmsg"}' in text
        with open(f"/proc/{p.pid}/maps") as f:
            numpy = [line.split()[-1] for line in f if "numpy" in line]
        assert numpy == [], f"an idle nettap has numpy mapped: {sorted(set(numpy))[:3]}"
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
