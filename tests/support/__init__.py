"""Helpers for the tests (and for the benchmarks under bench/, which import them as
`tests.support`): fault injection, sandboxes, job drivers. Not part of the installed package.
Modules here import each other relatively, so both import paths work."""
