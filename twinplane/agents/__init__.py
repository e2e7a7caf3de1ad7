"""Agents and environments the user brings, trained through the rollout plane's session endpoint."""
