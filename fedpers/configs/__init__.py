"""Every algorithm's frozen config class, the runtime options, and the enums and small validators
they need: what ``fedpers run ALGO --help`` lists and what refuses a bad value.

A light layer: no module here imports torch or an accounting library (a check that needs one
imports it inside the check), so the command line builds its parser and validates a run's whole
configuration before anything heavy is loaded. See docs/architecture.md."""
