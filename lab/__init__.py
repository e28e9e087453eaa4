"""The lab: device-call scripts, run logs and results JSON, apart from the product (see README.md)."""
