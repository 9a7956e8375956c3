"""Tests of keepstep.agent.dashboard."""
