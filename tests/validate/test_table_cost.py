"""The table-driven cost model (interpolated measured operator times) and `simengine profile` (needs torch)."""

import json

import numpy as np
import pytest

from simengine.core.batch import BatchShape
from simengine.cost.roofline import RooflineCost
from simengine.cost.table import TableCost, read_profile
from simengine.cost.timing import EngineTiming
from simengine.errors import InputError
from tests.conftest import make_dep

TIMING = EngineTiming(scheduler_cpu_s=1e-3, output_cpu_s=5e-4, overlap=False)


def table_csv(tmp_path, tp=1):
    p = tmp_path / "t.csv"
    p.write_text(f"# device=test\n# tp={tp}\nop,x,seconds\n"
                 "linear,1,0.0001\nlinear,1024,0.002\nlinear,8192,0.016\n"
                 "attn_prefill,1000,0.00001\nattn_prefill,1000000,0.001\n"
                 "attn_decode,1000,0.000005\nattn_decode,100000,0.0005\nlm_head,1,0.00005\nlm_head,1024,0.001\n")
    return p


def roofline(tp=1):
    dep = make_dep(tp=tp)
    return RooflineCost(dep.model, dep.hardware, weight_format=dep.weight_format, kv_elem_bytes=2.0, tp=tp,
                        timing=TIMING)


def test_curves_interpolate_floor_and_extrapolate_by_work(tmp_path):
    t = read_profile(table_csv(tmp_path))
    lin = t.curves["linear"]
    assert lin(0.5) == 0.0001 and lin(1024) == 0.002
    assert lin(512) == pytest.approx(0.0001 + (0.002 - 0.0001) * 511 / 1023)
    assert lin(16384) == pytest.approx(0.032)   # beyond the table: proportional to the tokens
    assert t.meta == {"device": "test", "tp": "1"}


def test_step_sums_layers_head_and_the_rooflines_comm_and_overheads(tmp_path):
    cost = TableCost(read_profile(table_csv(tmp_path)), roofline())
    L = cost.model.num_layers
    shape = BatchShape(num_decode=4, decode_context_tokens=4 * 1000, num_logits=4, padded_decode=4)
    lin = 0.0001 + (0.002 - 0.0001) * 3 / 1023
    att = 0.000005 + (0.0005 - 0.000005) * 3000 / 99000
    head = 0.00005 + (0.001 - 0.00005) * 3 / 1023
    expect = L * (lin + att) + head
    c = cost.step(shape)
    assert c.compute_s == pytest.approx(expect)
    assert c.seconds == pytest.approx(max(expect, cost.roofline.launch_s) + 1.5e-3)
    big = cost.step(BatchShape(prefill_chunks=[(4096, 0)], num_logits=1))
    assert big.seconds > c.seconds
    repeats = cost.decode_steps(shape, np.array([4004, 4008]))  # the repeated-step pricing: step per context
    assert [tuple(r) for r in repeats.tolist()] == [tuple(cost.step(BatchShape(
        num_decode=4, decode_context_tokens=ctx, num_logits=4, padded_decode=4))) for ctx in (4004, 4008)]


def test_bad_profiles_are_input_errors(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("op,x,seconds\nlinear,1,0.1\nconv,3,0.2\n")
    with pytest.raises(InputError, match=r"bad.csv:3"):
        read_profile(p)
    p.write_text("op,x,seconds\nlinear,1,0.1\n")
    with pytest.raises(InputError, match="no rows for attn_prefill, attn_decode"):
        read_profile(p)
    with pytest.raises(InputError, match="measured for tp=2"):
        TableCost(read_profile(table_csv(tmp_path, tp=2)), roofline())


def test_profile_on_cpu_with_a_tiny_model(tmp_path):
    pytest.importorskip("torch")
    from simengine.validate.profile import profile_command

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512}
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    out = tmp_path / "tiny.csv"
    msg = profile_command(str(path), out=str(out), device="cpu", dtype="fp32", tp=1, quick=True)
    assert "wrote" in msg
    table = read_profile(out)
    assert set(table.curves) == {"linear", "attn_prefill", "attn_decode", "lm_head"}
    assert table.meta["dtype"] == "fp32" and table.meta["model"] == "tiny"
