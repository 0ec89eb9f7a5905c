"""On a GPU: te_jax's CUDA handlers are command-buffer (CUDA graph) compatible, so XLA captures a
jitted chain of te_jax ops and jnp ops into command buffers, and the results are the same bits
with command buffers on and off. The dump parser itself is checked everywhere (CPU too).

XLA's dump (``--xla_dump_to``) writes, per module, ``*.thunk_sequence_after_thunk_passes.txt``:
one thunk a line, ``NNN: kKind [links] name``, the members of a ``kCommandBuffer`` indented below
it. A custom-call thunk's line may only say ``kCustomCall``; its HLO instruction is then found
through ``*.thunk_metadata.txt`` (thunk_id -> profile_annotation, the instruction's name) and the
instruction's ``custom_call_target`` in ``*after_optimizations.txt``.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "scripts" / "command_buffer_chain.py"
MODULE = "mlp_chain"  # the jitted function's name in the script

_THUNK_LINE = re.compile(r"^(?P<indent>\s*)(?P<id>\d+):\s+(?P<kind>k\w+)(?P<rest>.*)$")
_TE_TARGET = re.compile(r"\bte_jax_\w+")
_HLO_CUSTOM_CALL = re.compile(
    r"%?(?P<name>[\w.\-]+)\s*=\s*[^\n]*?\bcustom-call\([^\n]*?custom_call_target=\"(?P<target>[^\"]+)\""
)


def parse_thunks(text: str):
    """[(inside_command_buffer, thunk_id, kind, rest of line)] for every thunk line."""
    out = []
    cb_indent = None
    for line in text.splitlines():
        m = _THUNK_LINE.match(line)
        if not m:
            continue
        indent = len(m["indent"].expandtabs())
        inside = cb_indent is not None and indent > cb_indent
        if not inside:
            cb_indent = indent if m["kind"] == "kCommandBuffer" else None
        out.append((inside, int(m["id"]), m["kind"], m["rest"]))
    return out


def parse_thunk_metadata(text: str) -> dict[int, str]:
    """thunk_id -> profile_annotation (the HLO instruction's name)."""
    out = {}
    for block in text.split("thunk_metadata {")[1:]:
        ann = re.search(r'profile_annotation:\s*"([^"]*)"', block)
        tid = re.search(r"thunk_id:\s*(\d+)", block)
        if ann:
            out[int(tid.group(1)) if tid else 0] = ann.group(1)
    return out


def hlo_custom_calls(text: str) -> dict[str, str]:
    """HLO instruction name -> custom_call_target."""
    return {m["name"]: m["target"] for m in _HLO_CUSTOM_CALL.finditer(text)}


def te_jax_calls_in_command_buffers(thunks_text, metadata_text, hlo_text):
    """(te_jax targets of thunks inside command buffers, of thunks outside, of the HLO module)."""
    metadata = parse_thunk_metadata(metadata_text or "")
    calls = hlo_custom_calls(hlo_text)
    inside, outside = collections.Counter(), collections.Counter()
    for is_inside, tid, kind, rest in parse_thunks(thunks_text):
        target = None
        named = _TE_TARGET.search(rest)
        if named:
            target = named.group(0)
        elif kind == "kCustomCall":
            name = metadata.get(tid)
            if name is None:  # no metadata: the line may end with the instruction's name
                tokens = rest.split()
                name = tokens[-1] if tokens else None
            target = calls.get(name)
        if target and target.startswith("te_jax_"):
            (inside if is_inside else outside)[target] += 1
    in_module = collections.Counter(t for t in calls.values() if t.startswith("te_jax_"))
    return inside, outside, in_module


def _dump_files(dump: Path):
    def one(pattern, exclude=()):
        found = sorted(p for p in dump.glob(pattern) if not any(e in p.name for e in exclude))
        return found[-1] if found else None

    # Without command buffers XLA may skip the thunk passes (and their dump).
    thunks = one(f"*{MODULE}*thunk_sequence_after_thunk_passes.txt") or one(
        f"*{MODULE}*thunk_sequence.txt"
    )
    metadata = one(f"*{MODULE}*thunk_metadata.txt")
    hlo = one(
        f"*{MODULE}*after_optimizations.txt",
        exclude=("buffer-assignment", "memory-usage", "live-range"),
    )
    listing = sorted(p.name for p in dump.iterdir() if MODULE in p.name)
    assert thunks is not None and hlo is not None, f"no thunk/HLO dump for {MODULE}: {listing}"
    return (thunks.read_text(), metadata.read_text() if metadata else None, hlo.read_text())


def _run_chain(tmp_path: Path, name: str, extra_flags: str):
    dump = tmp_path / f"dump_{name}"
    out = tmp_path / f"{name}.npz"
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} {extra_flags}".strip()
    env.pop("TE_JAX_IMPLEMENTATION", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{name}: {proc.stdout[-5000:]}\n{proc.stderr[-10000:]}"
    with np.load(out) as f:
        arrays = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[-1]))]
    return dump, arrays


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="command buffers are a GPU feature")
def test_te_jax_ops_are_captured_in_command_buffers(tmp_path):
    import te_jax

    assert te_jax.ffi_available("gpu"), "the CUDA extension is not built/loaded"
    dump_on, on = _run_chain(tmp_path, "on", "")
    dump_off, off = _run_chain(tmp_path, "off", "--xla_gpu_enable_command_buffer=")

    assert len(on) == len(off) == 5
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i} differs with command buffers")

    inside, outside, in_module = te_jax_calls_in_command_buffers(*_dump_files(dump_on))
    assert len(in_module) >= 2 and sum(in_module.values()) >= 4, in_module
    assert inside == in_module and not outside, (
        f"te_jax custom calls inside command buffers {dict(inside)}, outside {dict(outside)}, "
        f"in the module {dict(in_module)}"
    )
    # With command buffers disabled nothing is captured (the dump parser tells the two apart).
    inside_off, outside_off, in_module_off = te_jax_calls_in_command_buffers(*_dump_files(dump_off))
    assert not inside_off and outside_off == in_module_off == in_module


# --- the parser, on text in the dump's format (runs everywhere) -----------------------------------

_THUNKS = """\
000: kCommandBuffer [source       | next=004 (1)]
    001: kCustomKernel [source       | next=002 (1)] loop_multiply_fusion grid: [32, 1, 1]
    002: kCustomCall   [prev=001 (1) | next=003 (1)] kCustomCall
    003: kCustomKernel [prev=002 (1) | sink        ] loop_tanh_fusion grid: [4, 1, 1]
004: kCustomCall    [prev=000 (1) | next=000 (1)] kCustomCall
000: kCommandBuffer [prev=004 (1) | sink        ]
    005: kCustomCall [source       | next=006 (1)] te_jax_dact_dbias_quantize
    006: kCustomKernel [prev=005 (1) | sink        ] wrapped_add grid: [1, 1, 1]
007: kCustomCall [prev=006 (1) | sink        ] kCustomCall
"""
_METADATA = """\
thunk_metadata {
  thunk_info {
    profile_annotation: "command_buffer_1"
  }
  thunk_kind: "kCommandBuffer"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "custom-call.2"
    thunk_id: 2
  }
  thunk_kind: "kCustomCall"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "custom-call.4"
    thunk_id: 4
  }
  thunk_kind: "kCustomCall"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "cholesky.0"
    thunk_id: 7
  }
  thunk_kind: "kCustomCall"
}
"""
_HLO = "\n".join(
    [
        "  %custom-call.2 = (bf16[256,384]{1,0}, f32[0]{0}) custom-call(%p.1, %c), "
        'custom_call_target="te_jax_act_lu", api_version=API_VERSION_TYPED_FFI',
        "  %custom-call.4 = (bf16[256,384]{1,0}, f32[0]{0}) custom-call(%p.2, %c), "
        'custom_call_target="te_jax_act_lu", api_version=API_VERSION_TYPED_FFI',
        "  %custom-call.5 = (bf16[256,2,384]{2,1,0}, bf16[2,384]{1,0}) custom-call(%a, %b), "
        'custom_call_target="te_jax_dact_dbias_quantize", api_version=API_VERSION_TYPED_FFI',
        "  %cholesky.0 = (f32[64,64]{0,1}, s32[]) custom-call(%bitcast.51.0), "
        'custom_call_target="cusolver_potrf_ffi", api_version=API_VERSION_TYPED_FFI',
    ]
)


def test_dump_parser():
    thunks = parse_thunks(_THUNKS)
    assert [(i, t, k) for i, t, k, _ in thunks] == [
        (False, 0, "kCommandBuffer"),
        (True, 1, "kCustomKernel"),
        (True, 2, "kCustomCall"),
        (True, 3, "kCustomKernel"),
        (False, 4, "kCustomCall"),
        (False, 0, "kCommandBuffer"),
        (True, 5, "kCustomCall"),
        (True, 6, "kCustomKernel"),
        (False, 7, "kCustomCall"),
    ]
    assert parse_thunk_metadata(_METADATA) == {
        0: "command_buffer_1",
        2: "custom-call.2",
        4: "custom-call.4",
        7: "cholesky.0",
    }
    inside, outside, in_module = te_jax_calls_in_command_buffers(_THUNKS, _METADATA, _HLO)
    assert inside == {"te_jax_act_lu": 1, "te_jax_dact_dbias_quantize": 1}
    assert outside == {"te_jax_act_lu": 1}  # thunk 4; thunk 7 is cusolver's, not te_jax's
    assert in_module == {"te_jax_act_lu": 2, "te_jax_dact_dbias_quantize": 1}
