"""Human text for the tests that run a real model (public domain, or written for this project): real prompts give
the attention patterns, norms and token statistics random token ids do not."""

DECLARATION = (  # The unanimous Declaration of the thirteen united States of America, 1776 (public domain)
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands which "
    "have connected them with another, and to assume among the powers of the earth, the separate and equal station "
    "to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind "
    "requires that they should declare the causes which impel them to the separation.\n"
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator "
    "with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure "
    "these rights, Governments are instituted among Men, deriving their just powers from the consent of the "
    "governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the People "
    "to alter or to abolish it, and to institute new Government, laying its foundation on such principles and "
    "organizing its powers in such form, as to them shall seem most likely to effect their Safety and Happiness. "
    "Prudence, indeed, will dictate that Governments long established should not be changed for light and transient "
    "causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are "
    "sufferable, than to right themselves by abolishing the forms to which they are accustomed. But when a long "
    "train of abuses and usurpations, pursuing invariably the same Object evinces a design to reduce them under "
    "absolute Despotism, it is their right, it is their duty, to throw off such Government, and to provide new "
    "Guards for their future security.")

GETTYSBURG = (  # Abraham Lincoln, Address at Gettysburg, 1863 (public domain)
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, "
    "and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil war, "
    "testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on a "
    "great battle-field of that war. We have come to dedicate a portion of that field, as a final resting place for "
    "those who here gave their lives that that nation might live. It is altogether fitting and proper that we should "
    "do this. But, in a larger sense, we can not dedicate, we can not consecrate, we can not hallow this ground. The "
    "brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add or "
    "detract.")

KITCHEN = (  # written for kvflow
    "Our kitchen notes for the week. On Monday we bake bread: five hundred grams of flour, ten grams of salt, a "
    "little yeast and three hundred and fifty grams of warm water, kneaded for ten minutes and left to rise until it "
    "doubles. On Tuesday the leftover bread becomes soup with onions, garlic and tomatoes. On Wednesday we roast "
    "vegetables from the market: carrots, beets and a squash, with olive oil and thyme. The oven runs hot, so "
    "everything needs about ten minutes less than the recipe says. Whoever cooks does not wash the dishes.")
