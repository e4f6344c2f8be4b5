"""Compiled regions (``torch.compile``): traced as Inductor runs them, or eagerly where that cannot
be modelled."""
