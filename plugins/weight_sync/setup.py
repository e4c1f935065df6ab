"""Shim for tools that still call setup.py; configuration lives in setup.cfg."""

from setuptools import setup

setup()
