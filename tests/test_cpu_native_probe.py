"""What minimlx says on the CPU when its native kernel is missing (minimlx/cpu/native.py `probe`): one line where
the install could have built it, the kernel's own reason where it was built for another MLX, nothing elsewhere."""

import sys

import pytest

from minimlx.cpu import native


@pytest.fixture
def no_kernel(monkeypatch):
    """An install where `import minimlx_native` fails as it does when setup.py could not build it."""
    monkeypatch.delenv("MINIMLX_NATIVE", raising=False)
    monkeypatch.setitem(sys.modules, "minimlx_native", None)


def test_a_linux_install_without_the_kernel_says_how_to_build_it(no_kernel, monkeypatch):
    monkeypatch.setattr(native.platform, "system", lambda: "Linux")
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert native.probe() == (None, native.UNBUILT)
    assert native.UNBUILT.count("\n") == 0 and "g++" in native.UNBUILT and "pip install -e ." in native.UNBUILT


def test_nothing_is_said_where_the_kernel_is_not_built_or_is_switched_off(no_kernel, monkeypatch):
    monkeypatch.setattr(native.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(native.platform, "machine", lambda: "arm64")
    assert native.probe() == (None, None)
    monkeypatch.setattr(native.platform, "system", lambda: "Linux")
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("MINIMLX_NATIVE", "off")
    assert native.probe() == (None, None)


BUILT_FOR_ANOTHER_MLX = "minimlx_native was built against mlx 0.1.0 but mlx 0.32.4 is installed; reinstall minimlx"
UNLOADABLE = "_ext.so: undefined symbol: _ZN3mlx4core5array8set_dataENS0_9allocator4DataE"


@pytest.mark.parametrize(
    "failure, note",
    [
        (f"raise ImportError({BUILT_FOR_ANOTHER_MLX!r})", f"note: {BUILT_FOR_ANOTHER_MLX}"),
        (
            f"raise ImportError({UNLOADABLE!r}, name='_ext')",
            f"note: minimlx's native CPU kernel does not load ({UNLOADABLE}); reinstall minimlx to rebuild it: "
            "pip install -e .",
        ),
    ],
)
def test_a_kernel_that_does_not_import_says_why_in_one_line(monkeypatch, tmp_path, failure, note):
    """A kernel built for another MLX says so itself; one whose library does not load (another MLX's symbols) is
    named with the loader's reason."""
    (tmp_path / "minimlx_native").mkdir()
    (tmp_path / "minimlx_native" / "__init__.py").write_text(failure + "\n")
    monkeypatch.delenv("MINIMLX_NATIVE", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "minimlx_native", raising=False)
    assert native.probe() == (None, note)
