"""The model repository: folders and versions, config parsing and validation."""
