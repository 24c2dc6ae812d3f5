"""The software's version: what HELLO and READY carry as `version`, what the HTTP APIs report; pyproject.toml reads
the package version from here."""
VERSION = "0.1.0"
