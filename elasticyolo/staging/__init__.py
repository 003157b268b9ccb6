"""`s3://` datasets and weights staged into a node-local cache: `stager.py` (list, fetch, verify),
`cache.py` (the cache on disk), `upload.py` (`elasticyolo data upload`). The agent's side of
staging is an agent plug-in (`agent/staging.py`)."""
