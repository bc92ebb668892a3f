"""Command-line interface (click); each command forwards to a public function."""
