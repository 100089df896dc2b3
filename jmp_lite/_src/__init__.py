"""Implementation of jmp_lite. Import from ``jmp_lite``, not from here."""
