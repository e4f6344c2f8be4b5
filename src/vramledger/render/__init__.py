"""Renderers: the library returns data; these turn it into terminal tables, JSON and HTML."""
