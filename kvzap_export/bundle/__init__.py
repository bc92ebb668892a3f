"""The deployment bundle: its manifest (the contract pipelines read) and its atomic writer."""

from kvzap_export.bundle.manifest import MANIFEST_NAME, SCHEMA_VERSION, read_manifest, sha256_file, tool_versions
from kvzap_export.bundle.writer import BundleWriter

__all__ = ["MANIFEST_NAME", "SCHEMA_VERSION", "BundleWriter", "read_manifest", "sha256_file", "tool_versions"]
