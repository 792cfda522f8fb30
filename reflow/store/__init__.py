"""The relational store every process shares: its tables, engines and migrations."""
