"""Run configuration: schema (schema.py) and loading with overrides and checks (load.py)."""
from vramfit.config.load import ConfigError, dump_config, load_config
from vramfit.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "dump_config", "load_config"]
