"""Import paths of 0.2 keep working for one release, with a DeprecationWarning naming the new
path (fslr_func._moved); the stable public names do not warn."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from fslr_func._moved import MOVED, STABLE


def test_every_old_path_is_its_new_module_with_one_deprecation_warning() -> None:
    script = textwrap.dedent(
        f"""
        import importlib, sys, warnings
        import fslr_func as ff
        moved, stable = {MOVED!r}, {STABLE!r}
        for old, new in {{**moved, **stable}}.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                exec(f"import {{old}}")  # an import statement, as user code has it
                module = sys.modules[old]
            assert module is importlib.import_module(new), old
            assert module.__spec__.name == new, (old, module.__spec__.name)
            messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
            if old in stable:
                assert messages == [], (old, messages)
            else:
                assert len(messages) == 1 and new in messages[0], (old, messages)
                assert caught[0].filename == "<string>", caught[0].filename  # the importer
        from fslr_func.recorder import Recorder  # the names themselves are the same objects
        assert Recorder is ff.Recorder
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ff.flerm.FLeRM is ff.FLeRM  # an old module read as an attribute
        try:
            ff.no_such_module
        except AttributeError as err:
            assert "no_such_module" in str(err)
        else:
            raise AssertionError("ff.no_such_module did not raise")
        assert callable(ff.exact) and ff.policies.__name__ == "fslr_func.training.policies"
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
