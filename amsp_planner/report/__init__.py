"""Rendering: tables and text built from evaluations; returns renderables/strings, never prints."""
