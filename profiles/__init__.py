"""Profiles shipped with specchat (TOML files in this folder, installed as `specchat.profiles`)."""
