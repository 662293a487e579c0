"""flashgen.compat: code written against flash_attn / FA3 / FA4 imports flashgen's modules after install(). Each
case runs in a fresh interpreter (sys.modules is process-wide), and the imports there are the ones such code writes."""
import os
import subprocess
import sys
import textwrap

import packaging.version

import flashgen

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(flashgen.__file__)))


def run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_imports_as_flash_attn_code_writes_them():
    out = run("""
        import importlib.util, torch
        import flashgen, flashgen.compat
        flashgen.compat.install()
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
        from flash_attn.flash_attn_interface import _flash_attn_forward
        from flash_attn.bert_padding import unpad_input, pad_input
        from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
        from flash_attn.modules.mha import MHA
        from flash_attn.utils.generation import InferenceParams
        from flash_attn.ops.triton.rotary import apply_rotary
        from flash_attn.cute import flash_attn_func as fa4_func
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4_varlen
        import flash_attn_interface
        import flash_attn.layers.rotary
        assert flash_attn_func is flashgen.flash_attn_func and flash_attn.flash_attn_func is flashgen.flash_attn_func
        assert flash_attn.layers.rotary.RotaryEmbedding is RotaryEmbedding
        assert apply_rotary is flashgen.layers.rotary.apply_rotary
        assert flash_attn_interface.flash_attn_func is flashgen.flash_attn_3.flash_attn_func
        assert fa4_func is flashgen.flash_attn_4.flash_attn_func
        assert fa4_varlen is flashgen.flash_attn_4.flash_attn_varlen_func
        assert flash_attn.__version__ == flashgen.compat.FLASH_ATTN_VERSION
        assert importlib.util.find_spec("flash_attn") is not None
        q = torch.randn(1, 5, 2, 16)
        out = flash_attn_func(q, q, q, causal=True)
        assert out.shape == q.shape and bool(torch.isfinite(out).all())
        assert flashgen.compat.install() == flashgen.compat.install()  # idempotent
        import flash_attn.cute.interface
        assert flash_attn.cute.interface is flashgen.flash_attn_4  # an attribute, as after a real import
        flashgen.compat.uninstall()
        import sys
        assert "flash_attn" not in sys.modules and not flashgen.compat.installed()
        assert not hasattr(flashgen.flash_attn_4, "interface")  # what install() set on flashgen's own module
        print("ok")
    """)
    assert out.strip() == "ok"


def test_what_flashgen_does_not_provide_fails_by_name():
    out = run("""
        import flashgen.compat
        flashgen.compat.install()
        for name in ("flash_attn.ops.fused_dense", "flash_attn.ops.triton.layer_norm", "flash_attn.models.gpt",
                     "flash_attn.losses.cross_entropy"):
            try:
                __import__(name)
            except ModuleNotFoundError as e:
                assert name.rsplit(".", 1)[0] in str(e), str(e)
            else:
                raise AssertionError(name + " imported")
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_real_flash_attn_already_imported_is_not_replaced():
    out = run("""
        import sys, types
        real = types.ModuleType("flash_attn")
        real.__file__ = "/site-packages/flash_attn/__init__.py"
        sys.modules["flash_attn"] = real
        import flashgen.compat
        try:
            flashgen.compat.install()
        except RuntimeError as e:
            assert "flash_attn: already imported" in str(e), str(e)
        else:
            raise AssertionError("installed over a real flash_attn")
        assert sys.modules["flash_attn"] is real
        print("ok")
    """)
    assert out.strip() == "ok"


def test_version_is_pep440():
    packaging.version.Version(flashgen.__version__)
