"""Runtimes move messages; they never compute statistics or add noise.

Import the runtime's own modules (:mod:`fedpers.runtime.local`, :mod:`fedpers.runtime.driver`, ...): this
package imports none of them, so two threads importing it and one of its modules at once cannot deadlock
on CPython's per-module import locks (Flower's simulation loads its apps in different threads).
"""
