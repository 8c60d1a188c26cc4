"""Agent specs: YAML files validated into pydantic models (see ``models``)."""
