"""The client SDK (and the rest of package ``tandem``: errors, stages, daemons, the ``make run``
demo) imports, builds requests and checks them against an edge's limits with only grpcio and
protobuf: torch, vLLM, ONNX Runtime, numpy and transformers are blocked in a fresh interpreter."""

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'vllm', 'onnxruntime', 'numpy', 'transformers'}:
            raise ImportError('blocked heavy import: ' + name)
sys.meta_path.insert(0, Block())
import tandem
import tandem.daemons, tandem.demo, tandem.errors, tandem.stages
from tandem.client import build_request
r = build_request([{'role': 'user', 'content': 'hi'}], max_new_tokens=8, seed=7, session_id='s', mode='split',
                  stop=['###'], stop_token_ids=[2])
assert r.sampling.seed == 7 and r.messages[0].content == 'hi'
assert list(r.stop) == ['###'] and list(r.sampling.stop_token_ids) == [2]
tandem.EdgeInfo('m', 4, 2048, 512, 16, 64, 120.0, 'v').check(max_new_tokens=8, stop=['###'])
assert issubclass(tandem.Unavailable, tandem.TandemClientError)
print('ok', tandem.Client.__name__, tandem.AsyncClient.__name__)
"""


def test_sdk_imports_without_heavy_packages():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok Client AsyncClient")


def test_the_demo_report_keeps_its_columns_aligned_whatever_the_label():
    """``make run``'s tables: every row's numbers start in the same column, in both tables, the
    longest stage label (the remote-prefill ones) included."""
    from tandem.demo import report
    from tandem.stages import Stage
    from tandem.streams import ChatResult

    r = ChatResult("x", "length", 10, 4, 10, 0, 4, (1, 2, 3, 4), timings_ms={Stage.CLOUD_DECODE: 12.5}, mode="split")
    text = report({"split k=4": r, "plain vLLM": r})
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("Per-", "Tokens"))]
    assert len(lines) > 10
    assert len({len(ln) for ln in lines}) == 1, "\n".join(lines)
