"""matplotlib for the commands that draw (`lens --png`, `attention --plot`): an optional dependency."""

from pathlib import Path

from ..errors import InvalidSettingError


def pyplot(option: str, path: str):
    """matplotlib's pyplot drawing to files, or the one-line error that says how to install it, or that the
    picture's folder does not exist (call it before the model loads, so that either fails at once)."""
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        raise InvalidSettingError(f"{option} {path}: the folder {folder} does not exist; create it or name another")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidSettingError(f"{option} needs matplotlib; install it with pip install 'minimlx[plot]'") from None
    return plt


def shown(token: str) -> str:
    """A token as a plot label: escapes as in repr, spaces visible as ␣."""
    return repr(token)[1:-1].replace(" ", "␣")


def save(plt, figure, path: str) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)
