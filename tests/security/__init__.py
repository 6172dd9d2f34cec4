"""Security tests (issue 26): each defect found by an independent probe, against a real gateway."""
