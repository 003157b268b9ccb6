"""Make Ultralytics run with no network at all. Must run before `import ultralytics`.

Ultralytics otherwise pings for connectivity, checks for updates, sends telemetry (sync), and
downloads Arial fonts even when offline. We point its config dir at a directory this project owns,
turn all of that off, and seed the fonts from matplotlib's bundled DejaVuSans.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

FONTS = ("Arial.ttf", "Arial.Unicode.ttf")


def config_root() -> Path:
    """Where Ultralytics' config, fonts and matplotlib's cache go: `$ELASTICYOLO_HOME`, else the
    systemd unit's StateDirectory (`$STATE_DIRECTORY`), else `$XDG_CACHE_HOME/elasticyolo`, else
    `~/.cache/elasticyolo`. Under the shipped unit HOME is not writable: never fall back to it there."""
    env = os.environ
    if env.get("ELASTICYOLO_HOME"):
        return Path(env["ELASTICYOLO_HOME"])
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    return Path(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "elasticyolo"


def setup_offline() -> Path:
    """Idempotent; returns the Ultralytics config dir. Honours a YOLO_CONFIG_DIR set by the user."""
    root = config_root()
    yolo_dir = Path(os.environ.setdefault("YOLO_CONFIG_DIR", str(root / "yolo")))
    os.environ.setdefault("MPLCONFIGDIR", str(root / "matplotlib"))
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ["YOLO_AUTOINSTALL"] = "False"
    os.environ.setdefault("YOLO_VERBOSE", "False")
    ultra = yolo_dir / "Ultralytics"
    ultra.mkdir(parents=True, exist_ok=True)
    Path(os.environ["MPLCONFIGDIR"]).mkdir(parents=True, exist_ok=True)
    settings = ultra / "settings.json"
    if not settings.exists():
        # Only the keys we care about; Ultralytics fills in the rest without a network call.
        settings.write_text(json.dumps({"sync": False, "hub": False, "api_key": ""}))
    missing = [f for f in FONTS if not (ultra / f).exists()]
    if missing:
        import matplotlib

        dejavu = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
        for name in missing:
            tmp = ultra / f".{name}.tmp{os.getpid()}"
            shutil.copyfile(dejavu, tmp)
            os.replace(tmp, ultra / name)  # atomic: workers start concurrently
    return ultra


def disable_ultralytics_network() -> None:
    """After import: make sure settings say no sync, and nothing considers itself online."""
    from ultralytics.utils import SETTINGS

    if SETTINGS.get("sync"):
        SETTINGS.update({"sync": False})
    import ultralytics.utils as uu

    uu.ONLINE = False
