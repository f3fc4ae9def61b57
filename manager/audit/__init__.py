"""The audit log of admin changes: what a request or a CLI command asked and what came of it, written once
per change by the trail (``trail.AuditTrail``, around every route) into the store (``store``)."""
