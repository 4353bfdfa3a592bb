// MathJax for pymdownx.arithmatex (generic mode): typeset \( \) and \[ \] spans it marks, on every page load
// (Material's instant navigation included).
// textmacros: \_ and the like inside \text{...}, as LaTeX reads them (the docstrings write \text{agg\_grad}).
window.MathJax = {
  loader: { load: ["[tex]/textmacros"] },
  tex: {
    packages: { "[+]": ["textmacros"] },
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
