"""Tests of keepstep.dashboard."""
