"""Test suite; a package so pytest puts the repository root (not tests/) on sys.path.

Without this file tests/lightning/ would shadow the real ``lightning`` package.
"""
