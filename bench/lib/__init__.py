"""The parts of bench/run.py and of its streaming group, one concern a module (bench/README.md lists them).
Imported as `lib.<module>`: run.py puts bench/ and the project root on sys.path first."""
