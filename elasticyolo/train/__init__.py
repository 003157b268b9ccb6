"""Engine-neutral training core (torch + Ultralytics). Importing it makes Ultralytics offline."""

from elasticyolo.train.offline import setup_offline as _setup_offline

_setup_offline()
